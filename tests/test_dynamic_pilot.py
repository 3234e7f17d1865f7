"""The pilot: Markov fallback, LightGBM's fast path, online training, files, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import warnings

import lightgbm as lgb
import numpy as np
import pytest

from memcompile.dynamic.fastpredict import FastBooster
from memcompile.dynamic.markov import UNKNOWN, MarkovPredictor
from memcompile.dynamic.pilot import Pilot, PilotStats, Prediction
from memcompile.dynamic.rules import RoutingRule
from memcompile.errors import PilotWarning

# A step is "E", then an "R" router block and one of two expert pairs chosen by the step's
# input size, twice. The block after "R" depends on the sizes (Markov sees only "R" and keeps
# guessing what followed last time); the block after an expert depends on which expert it is.
_CHOICES = (("X1", "X2"), ("Y1", "Y2"))


def _step(rng: np.random.Generator) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [("E", "fe", (8,))]
    for layer in range(2):
        pick = int(rng.integers(2))
        out.append((f"R{layer}", "fr", (4 + pick,)))
        out.extend((f"{layer}{b}", "fx", (4 + pick,)) for b in _CHOICES[pick])
    out.append(("H", "fh", (8,)))
    return out


def _run(pilot: Pilot, steps: int, seed: int = 0, *, wait: bool = True) -> list[str]:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for block, fragment, sizes in _step(rng):
            pilot.observe(block, fragment, sizes, (0, 1, 0, 1, 0, 0))
            pilot.predict()
        pilot.end_step()
        if wait:
            pilot.wait()
    return pilot._labels


def test_markov_predicts_last_successors() -> None:
    m = MarkovPredictor(horizon=2)
    assert m.predict() == (UNKNOWN, UNKNOWN)
    for b in (0, 1, 2, 0, 1, 3):
        m.observe(b)
    assert m.predict() == (UNKNOWN, UNKNOWN)  # nothing followed 3 yet
    m.observe(0)
    assert m.predict() == (1, 3)  # what followed 0 last time, 1 and 2 calls ahead
    with pytest.raises(ValueError, match="horizon must be an int >= 1; got 0"):
        MarkovPredictor(horizon=0)
    with pytest.raises(ValueError, match="block ids are >= 0; got -1"):
        m.observe(-1)


def test_fast_path_matches_booster_predict() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 6))
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5)
    params = {"objective": "multiclass", "num_class": 3, "verbose": -1, "num_threads": 1}
    booster = lgb.train({**params, "seed": 0, "deterministic": True}, lgb.Dataset(x, y), 5)
    fast = FastBooster(booster)
    assert fast.out.shape == (3,)
    for row in x[:20]:
        fast.row[:] = row
        np.testing.assert_allclose(fast.predict(), booster.predict(row[None])[0], rtol=1e-12)
    # a booster read back from its text predicts the same through the fast path
    again = FastBooster(lgb.Booster(model_str=booster.model_to_string()))
    again.row[:] = x[0]
    fast.row[:] = x[0]
    np.testing.assert_array_equal(again.predict(), fast.predict())


def test_lightgbm_beats_markov_where_the_next_block_depends_on_features() -> None:
    pilot = Pilot(horizon=2, warmup_steps=10, retrain_every=10, background=False)
    _run(pilot, 60)
    stats = pilot.stats()
    markov = Pilot(horizon=2, warmup_steps=10_000, background=False)  # never trains
    _run(markov, 60)
    base = markov.stats()
    assert stats.active == "lightgbm" and base.active == "markov"
    assert stats.models_trained == 6
    # After "R" and after each layer's second expert, Markov is right half the time.
    assert base.accuracy < 0.9
    # (the first 10 steps are Markov's in both; 2 ahead of "R" is a coin toss for both)
    assert stats.accuracy > base.accuracy + 0.07, (stats, base)
    assert stats.k_ahead_accuracy > base.k_ahead_accuracy + 0.05, (stats, base)
    assert stats.predict_us_p50 is not None and stats.predict_us_p50 > 0
    assert isinstance(stats, PilotStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.accuracy = 1.0  # type: ignore[misc]


def test_predictions_name_blocks_and_their_source() -> None:
    pilot = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False, threshold=0.0)
    labels = _run(pilot, 10)
    pilot.observe("E", "fe", (8,))
    p = pilot.predict()
    assert p.sources == ("lightgbm", "lightgbm")
    assert p.blocks[0] in ("R0",) and p.blocks[1] in ("0X1", "0Y1")
    assert all(0.0 <= c <= 1.0 for c in p.confidence)
    assert set(labels) >= {"E", "R0", "H"}
    # below the threshold, the Markov prediction is used
    cautious = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False, threshold=1.0)
    _run(cautious, 10)
    cautious.observe("R0", "fr", (4,))
    q = cautious.predict()
    assert "markov" in q.sources
    assert cautious.stats().fallback_rate > 0


def test_background_training_is_deterministic(tmp_path) -> None:
    a = Pilot(horizon=2, warmup_steps=5, retrain_every=5, seed=3)
    b = Pilot(horizon=2, warmup_steps=5, retrain_every=5, seed=3)
    for p in (a, b):
        _run(p, 5, wait=False)  # the 5th step starts a training thread
        assert p.active == "markov" or p.models_trained == 1
        p.wait()
        assert p.active == "lightgbm" and p.models_trained == 1
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    for name in ("h1.txt", "h2.txt", "meta.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


def test_saved_models_are_lightgbm_text_and_load_in_a_new_pilot(tmp_path) -> None:
    pilot = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False, threshold=0.0)
    _run(pilot, 10)
    pilot.save(tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == ["h1.txt", "h2.txt", "meta.json"]
    assert (tmp_path / "m" / "h1.txt").read_text().startswith("tree\n")  # no pickle
    fresh = Pilot(horizon=2, warmup_steps=5, background=False, threshold=0.0)
    assert fresh.load(tmp_path / "m") is True
    assert fresh.active == "lightgbm"
    for p in (pilot, fresh):
        p.observe("E", "fe", (8,), (0, 1, 0, 1, 0, 0))
        p.observe("R0", "fr", (5,), (0, 1, 0, 1, 0, 0))
    assert fresh.predict().blocks == pilot.predict().blocks


def test_missing_or_corrupt_models_warn_and_fall_back_to_markov(tmp_path) -> None:
    pilot = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False)
    _run(pilot, 5)
    pilot.save(tmp_path / "m")
    fresh = Pilot(horizon=2, background=False)
    with pytest.warns(PilotWarning, match=r"cannot load .*nowhere.*markov predictor"):
        assert fresh.load(tmp_path / "nowhere") is False
    (tmp_path / "m" / "h1.txt").write_text("tree\nthis is not a model\n")
    with pytest.warns(PilotWarning, match="cannot load"):
        assert fresh.load(tmp_path / "m") is False
    assert fresh.active == "markov"
    (tmp_path / "m" / "meta.json").write_text("{not json")
    with pytest.warns(PilotWarning, match="cannot load"):
        assert fresh.load(tmp_path / "m") is False
    # a model for another horizon is refused, too
    pilot.save(tmp_path / "m")
    with pytest.warns(PilotWarning, match="other features or another horizon"):
        assert Pilot(horizon=3).load(tmp_path / "m") is False
    fresh.observe("E", "fe", (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.predict().sources == ("markov", "markov")


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="Pilot: horizon must be an int >= 1; got 0"):
        Pilot(horizon=0)
    with pytest.raises(ValueError, match="Pilot: window must be an int >= 16; got 4"):
        Pilot(window=4)
    with pytest.raises(ValueError, match=r"Pilot: threshold must be in \[0, 1\]; got 1.5"):
        Pilot(threshold=1.5)
    with pytest.raises(ValueError, match=r"Pilot: learning_rate must be in \(0, 1\]; got 0.0"):
        Pilot(learning_rate=0.0)
    with pytest.raises(RuntimeError, match=r"Pilot\.save: no model yet"):
        Pilot().save("/nonexistent")


# A router stream: "R{layer}" emits per-expert counts (each of 6 experts on with probability
# 1/2) and a vector of noise; the experts with a nonzero count run next, in expert order. What
# follows "R" or an expert is a coin toss for Markov and for features without the outputs.
_EXPERTS = 6


def _router_step(rng: np.random.Generator) -> list[tuple[str, str, tuple[tuple[int, ...], ...]]]:
    out: list[tuple[str, str, tuple[tuple[int, ...], ...]]] = [("E", "fe", ())]
    for layer in range(3):
        counts = tuple(int(c) for c in rng.integers(1, 4, _EXPERTS) * (rng.random(_EXPERTS) < 0.5))
        noise = tuple(int(x) for x in rng.integers(0, 5, _EXPERTS))
        out.append((f"R{layer}", "fr", (noise, counts)))
        out.extend((f"{layer}x{p}", "fx", ()) for p, c in enumerate(counts) if c)
    out.append(("H", "fh", ()))
    return out


def _run_router(
    pilot: Pilot, steps: int, *, outputs: bool, live: bool = False, after: int = 15
) -> tuple[float, float]:
    """Replay ``steps`` router steps; 1- and 2-ahead accuracy of predictions from step ``after``."""
    rng = np.random.default_rng(1)
    seq: list[tuple[int, str]] = []
    preds: list[tuple[str | None, ...]] = []
    for step in range(steps):
        for block, fragment, outs in _router_step(rng):
            seq.append((step, block))
            if not outputs:
                pilot.observe(block, fragment, (8,))
            elif live:  # as the compiler reports them: outputs once the block returned
                pilot.observe(block, fragment, (8,))
                pilot.observe_outputs(outs)
            else:
                pilot.observe(block, fragment, (8,), outputs=outs)
            preds.append(pilot.predict().blocks)
        pilot.end_step()
        pilot.wait()
    made = [t for t in range(len(seq) - 2) if seq[t][0] >= after]
    return tuple(  # type: ignore[return-value]
        sum(preds[t][j - 1] == seq[t + j][1] for t in made) / len(made) for j in (1, 2)
    )


def test_router_outputs_predict_the_experts_markov_cannot() -> None:
    kw = dict(horizon=2, warmup_steps=5, retrain_every=5, background=False)
    with_outputs, without = Pilot(**kw), Pilot(**kw)
    acc = _run_router(with_outputs, 60, outputs=True)
    base = _run_router(without, 60, outputs=False)
    markov = _run_router(Pilot(**{**kw, "warmup_steps": 10_000}), 60, outputs=False)
    # the next expert is a coin toss without the counts (for Markov and for LightGBM)
    assert base[0] < 0.75 and markov[0] < 0.75, (base, markov)
    # with them: exact after the rule is learnt (step 15 on), except 2 ahead of a layer's last
    # expert (the next router has not run: its first expert is a guess)
    assert acc[0] == 1.0, acc
    assert acc[1] > 0.8 and acc[1] > base[1] + 0.15 and acc[1] > markov[1] + 0.15, (acc, base)
    a, b = with_outputs.stats(), without.stats()
    assert a.rule_rate > 0.5 and b.rule_rate == 0.0
    # the counts are the rule, never the noise beside them (slot 0), nor a block's other output
    stats = {(r.block, r.slot): r for r in with_outputs.rule.slot_stats(with_outputs._labels)}
    assert all(stats[(f"R{i}", 1)].trusted for i in range(3))
    assert not any(stats[(f"R{i}", 0)].trusted for i in range(3))
    assert stats[("R0", 1)].accuracy == 1.0
    # outputs given after the block (the compiler's order) predict the same
    live = Pilot(**kw)
    assert _run_router(live, 60, outputs=True, live=True) == acc
    assert live.stats() == dataclasses.replace(a, predict_us_p50=live.stats().predict_us_p50)
    # right after a router, the rule names the experts it listed
    with_outputs.observe("E", "fe", (8,))
    with_outputs.observe("R0", "fr", (8,), outputs=((0,) * 6, (0, 2, 0, 0, 1, 0)))
    p = with_outputs.predict()
    assert p.blocks == ("0x1", "0x4") and p.sources == ("rule", "rule")
    assert p.confidence == (1.0, 1.0)


def test_saved_pilot_keeps_its_rule_and_a_corrupt_rule_falls_back(tmp_path) -> None:
    pilot = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False)
    _run_router(pilot, 20, outputs=True)
    pilot.save(tmp_path / "m")
    fresh = Pilot(horizon=2, background=False)
    assert fresh.load(tmp_path / "m") is True
    fresh.observe("R1", "fr", (8,), outputs=((0,) * 6, (3, 0, 0, 1, 0, 0)))
    assert fresh.predict().blocks == ("1x0", "1x3")
    meta = tmp_path / "m" / "meta.json"
    data = json.loads(meta.read_text())
    data["rules"][0]["by_position"] = "garbage"
    meta.write_text(json.dumps(data))
    other = Pilot(horizon=2, background=False)
    with pytest.warns(PilotWarning, match="cannot load"):
        assert other.load(tmp_path / "m") is False
    assert other.active == "markov"
    other.observe("R1", "fr", (8,), outputs=((0,) * 6, (3, 0, 0, 1, 0, 0)))
    assert other.predict().sources == ("markov", "markov")  # nothing learnt, nothing loaded
    data["format"] = 1  # a model saved before the rule features existed
    meta.write_text(json.dumps(data))
    with pytest.warns(PilotWarning, match="format 1, expected 2"):
        assert other.load(tmp_path / "m") is False


def test_rule_follows_a_plan_through_a_wrong_block_and_keeps_it_against_weaker_slots() -> None:
    rule = RoutingRule(min_checks=2)
    r, a, b, c, x = 0, 1, 2, 3, 4
    for counts, seq in (((1, 1, 0), (a, b)), ((0, 1, 1), (b, c)), ((1, 0, 1), (a, c))) * 2:
        rule.observe(r)
        rule.emitted(r, [counts])
        for blk in seq:
            rule.observe(blk)
        rule.observe(x)  # the exit
    rule.end_step()
    rule.observe(r)
    rule.emitted(r, [(2, 0, 3)])
    assert (rule.ahead(1), rule.ahead(2), rule.ahead(3), rule.ahead(4)) == (a, c, x, UNKNOWN)
    assert rule.left == 3
    rule.observe(b)  # not the block listed: it still takes its place in the run
    assert rule.ahead(1) == c and rule.substitutions == 1
    rule.emitted(b, [(1,)])  # an untrusted output does not replace the plan
    assert rule.ahead(1) == c
    rule.observe(c)
    rule.observe(a)  # not the exit: the plan ends
    assert rule.ahead(1) == UNKNOWN and rule.left == 0
    with pytest.raises(ValueError, match="min_checks must be >= 1"):
        RoutingRule(min_checks=0)


def test_boosters_share_one_row_buffer_and_best_is_the_argmax() -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 5))
    params = {"objective": "multiclass", "verbose": -1, "num_threads": 1, "seed": 0}
    one = lgb.train({**params, "num_class": 3}, lgb.Dataset(x, (x[:, 0] > 0) + (x[:, 1] > 0)), 4)
    two = lgb.train({**params, "num_class": 2}, lgb.Dataset(x, (x[:, 2] > 0).astype(int)), 4)
    row = np.zeros(5)
    a, b = FastBooster(one, row=row), FastBooster(two, row=row)
    assert a.row is row and b.row is row
    for r in x[:10]:
        row[:] = r  # written once, read by both
        for fast, booster in ((a, one), (b, two)):
            probs = booster.predict(r[None])[0]
            i, p = fast.best()
            assert i == int(probs.argmax()) and p == pytest.approx(probs.max(), rel=1e-12)
    with pytest.raises(ValueError, match=r"row must be a C-contiguous float64 array of shape"):
        FastBooster(one, row=np.zeros(4))
    with pytest.raises(ValueError, match=r"row must be a C-contiguous float64 array of shape"):
        FastBooster(one, row=np.zeros(5, dtype=np.float32))


def test_best_of_reads_the_packed_row_in_place_and_answers_as_best() -> None:
    """``best_of(bytes)`` (the pilot's path) gives exactly ``best()``'s answer for the same row,
    leaves the row buffer alone, and refuses bytes of the wrong length (the C call would read
    past them)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 5))
    x[rng.random(x.shape) < 0.1] = np.nan  # missing values travel through the bytes too
    params = {"objective": "multiclass", "verbose": -1, "num_threads": 1, "seed": 0}
    y = (np.nan_to_num(x[:, 0]) > 0) + (np.nan_to_num(x[:, 1]) > 0)
    fast = FastBooster(lgb.train({**params, "num_class": 3}, lgb.Dataset(x, y), 4))
    fast.row[:] = 7.0
    for r in x[:20]:
        i, p = fast.best_of(struct.pack("5d", *r))
        assert np.all(fast.row == 7.0)  # not written
        again = FastBooster(fast.booster)
        again.row[:] = r
        assert (i, p) == again.best()  # bit-identical probability
    with pytest.raises(ValueError, match=r"best_of: data must be 40 bytes \(float64 per feature\)"):
        fast.best_of(struct.pack("4d", 0, 0, 0, 0))
    with pytest.raises(ValueError, match=r"best_of: data must be 40 bytes"):
        fast.best_of(bytearray(40))  # type: ignore[arg-type]


def test_repeated_rows_reuse_the_boosters_answers_of_the_current_models() -> None:
    """A row seen before is answered without the boosters, and exactly as they would answer;
    a new model (retraining) never answers with the old one's results."""
    pilot = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False, threshold=0.0)
    rng = np.random.default_rng(0)
    checked = 0
    models_seen = set()
    for _ in range(25):
        for block, fragment, sizes in _step(rng):
            pilot.observe(block, fragment, sizes, (0, 1, 0, 1, 0, 0))
            p = pilot.predict()
            models = pilot._models
            if models is None:
                continue
            models_seen.add(id(models))
            row = np.array(pilot._row, dtype=np.float64)[None]
            for j, m in enumerate(models):
                if m.booster is None:
                    continue
                probs = m.booster.predict(row)[0]  # the Python API: no buffer, no reuse
                assert p.sources[j] == "lightgbm"
                assert p.blocks[j] == pilot._labels[int(m.classes[probs.argmax()])]
                assert p.confidence[j] == pytest.approx(probs.max(), rel=1e-12)
                checked += 1
        pilot.end_step()
    assert checked > 100 and len(models_seen) == 4  # trained after steps 5, 10, 15, 20 (, 25)
    reuse = pilot.stats().reuse_rate
    assert reuse is not None and 0.3 < reuse < 1.0, reuse
    assert pilot.stats().to_dict()["reuse_rate"] == reuse


def test_rule_votes_keep_the_most_voted_block_smallest_id_on_ties() -> None:
    from memcompile.dynamic.rules import _most_voted, _Slot

    s = _Slot()
    rng = np.random.default_rng(5)
    for _ in range(200):
        p, v, b = int(rng.integers(3)), int(rng.integers(4)), int(rng.integers(4))
        s.vote(p, v, b)
        s.vote_exit(b)
        for key, votes in s.by_value.items():
            assert s.best_value[key] == _most_voted(votes)  # kept as it goes, ties included
        for key, votes in s.by_position.items():
            assert s.best_position[key] == _most_voted(votes)
        assert s.exit_label() == _most_voted(s.exit_votes)[0]
    before = (dict(s.best_value), dict(s.best_position), dict(s.best_exit))
    s.best_value, s.best_position, s.best_exit = {}, {}, {}
    s.rebuild_best()  # as after loading the votes
    assert (s.best_value, s.best_position, s.best_exit) == before
    assert s.label(0, 7) == (s.best_value[(0, 2)][0], True)  # values >= 2 share a bucket
    assert _Slot().label(0, 1) == (UNKNOWN, False)


def test_rule_accuracy_counts_follow_the_window() -> None:
    from memcompile.dynamic.rules import _Recent

    r = _Recent(4)
    assert r.accuracy() is None
    for ok in (True, True, False, True, False, False):
        r.append(ok)
    assert list(r) == [False, True, False, False] and r.right == 1 and r.accuracy() == 0.25


def _reference_prediction(pilot: Pilot) -> tuple[tuple, tuple, tuple]:
    """What predict() must answer, computed the obvious way: the rule where its plan covers a
    horizon, else the booster's most probable class through LightGBM's Python API (no fast
    path, no stored answers) when its probability reaches the threshold or Markov knows
    nothing, else Markov."""
    ids = list(pilot.markov.predict())
    sources, conf = ["markov"] * pilot.horizon, [float("nan")] * pilot.horizon
    row = np.array(pilot._row, dtype=np.float64)[None]
    for j in range(pilot.horizon):
        r = pilot.rule.ahead(j + 1)
        if r != UNKNOWN:
            ids[j], sources[j], conf[j] = r, "rule", 1.0
            continue
        m = pilot._models[j] if pilot._models is not None else None
        if m is None:
            continue
        if m.booster is None:
            b, p = m.labels[0], 1.0
        else:
            probs = m.booster.predict(row, num_threads=1)[0]
            b, p = m.labels[int(probs.argmax())], float(probs.max())
        if p >= pilot.threshold or ids[j] == UNKNOWN:
            ids[j], sources[j], conf[j] = b, "lightgbm", p
    names = tuple(pilot._labels[i] if i != UNKNOWN else None for i in ids)
    return names, tuple(sources), tuple(conf)


def test_the_hot_path_answers_as_the_obvious_computation() -> None:
    """predict() (inlined C calls, stored answers, source codes, a named tuple) gives exactly
    the blocks, sources and probabilities of the obvious computation, for every source and
    mix of them, and counts its sources as they were."""
    pilot = Pilot(horizon=2, warmup_steps=5, retrain_every=5, background=False)
    rng = np.random.default_rng(3)
    seen: dict[tuple[str, ...], int] = {}
    for _ in range(30):
        for block, fragment, outs in _router_step(rng):
            pilot.observe(block, fragment, (8,), outputs=outs)
            expected = _reference_prediction(pilot)
            p = pilot.predict()
            assert isinstance(p, Prediction) and p.blocks == expected[0], (p, expected)
            assert p.sources == expected[1]
            # bit-identical probabilities (nan where Markov predicted)
            assert struct.pack("2d", *p.confidence) == struct.pack("2d", *expected[2])
            seen[p.sources] = seen.get(p.sources, 0) + 1
        pilot.end_step()
    # the rule alone, LightGBM after it, LightGBM and Markov mixed: all exercised
    assert {("rule", "rule"), ("rule", "lightgbm"), ("lightgbm", "markov")} <= set(seen), seen
    predictions = sum(seen.values())
    assert pilot.stats().rule_rate == pytest.approx(
        sum(n * s.count("rule") for s, n in seen.items()) / (2 * predictions)
    )
    assert pilot.stats().predict_us_p50 > 0  # one call in 8 timed
    # a Prediction is immutable, and equal to the tuple of its fields
    with pytest.raises(AttributeError):
        p.blocks = ()  # type: ignore[misc]
    assert p == (p.blocks, p.sources, p.confidence)


def test_markov_successors_and_rule_plan_prefix_match_their_per_horizon_answers() -> None:
    """The hot path reads Markov's prediction as a fresh list and the rule's plan as one
    prefix: the same values as predict() and ahead(j) one horizon at a time."""
    m = MarkovPredictor(horizon=3)
    assert m.successors() == [UNKNOWN] * 3
    for b in (0, 1, 2, 3, 0):
        m.observe(b)
    got = m.successors()
    assert got == list(m.predict()) == [1, 2, 3]
    got[0] = 9  # the caller's own list
    assert m.predict() == (1, 2, 3)
    rule = RoutingRule(min_checks=1)
    for _ in range(3):
        rule.observe(0)
        rule.emitted(0, ((0, 2, 1),))  # positions 1 and 2 run next
        rule.observe(1)
        rule.observe(2)
        rule.observe(7)
        rule.end_step()
    rule.observe(0)
    rule.emitted(0, ((0, 2, 1),))
    plan = rule.plan_ahead(3)
    assert len(plan) >= 2 and plan == tuple(rule.ahead(j) for j in range(1, len(plan) + 1))
    assert all(rule.ahead(j) == UNKNOWN for j in range(len(plan) + 1, 4))
    rule.observe(plan[0])
    assert rule.plan_ahead(3) == plan[1:]
