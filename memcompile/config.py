"""Options: the frozen :class:`MemConfig`, validated once, at compile time.

    MemConfig.from_options({"budget": "6GiB", "inner": "eager"})
    MemConfig(budget=6442450944, ..., inner='eager', ...)

Every key DESIGN.md names is accepted. Unknown keys and bad values raise ``ValueError`` /
``TypeError`` whose message names the key; values that need a feature which has not landed yet
raise ``NotImplementedError`` naming that feature, never a silent no-op.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

log = logging.getLogger(__name__)

__all__ = [
    "DEVICE_PROFILES",
    "OPTIONS_ENV",
    "VERSION",
    "MemConfig",
    "env_options",
    "option_value",
    "parse_bytes",
    "parse_fraction",
    "resolve_inner",
]

#: memcompile's version (``memcompile.__version__``); here, in the lowest room, so that what
#: records it (the plan cache's keys) need not import the package.
VERSION = "0.1.0"

#: Options for the ``torch.compile(backend="memcompile")`` calls of code the user does not write
#: (a framework that takes the backend's name from its config and passes no options, as
#: torchtitan's ``compile.backend``): ``KEY=VALUE`` pairs separated by commas, e.g.
#: ``budget=60%,offload_params=true``. A key the call's own ``options`` give wins;
#: ``memcompile.compile`` does not read it.
OPTIONS_ENV = "MEMCOMPILE_OPTIONS"


def option_value(text: str) -> Any:
    """An option's value as typed on a command line or in :data:`OPTIONS_ENV`: ``true`` /
    ``false``, ``none``, an integer, else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def env_options(text: str | None = None) -> dict[str, Any]:
    """The options :data:`OPTIONS_ENV` gives (``text``: its value; default: the environment's),
    validated.

    Raises:
        ValueError, TypeError: a pair is not ``KEY=VALUE``, or ``MemConfig.from_options``
            refuses it; the message names the variable.
    """
    if text is None:
        text = os.environ.get(OPTIONS_ENV, "")
    out: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{OPTIONS_ENV}: {pair!r} is not KEY=VALUE (e.g. budget=6GiB)")
        out[key.strip()] = option_value(value.strip())
    try:
        MemConfig.from_options(out)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{OPTIONS_ENV}={text!r}: {e}") from None
    return out


#: Cost-model profiles ``device_profile`` may name.
DEVICE_PROFILES: tuple[str, ...] = ("auto", "cpu", "h100", "h200", "a100")

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, key: str = "budget") -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"6GB"``, ``"1.5 GiB"``.

    ``KB/MB/GB/TB`` are decimal (10**3…), ``KiB/MiB/GiB/TiB`` binary (2**10…), case-insensitive.
    A fraction of a unit that is not a whole byte count (``"1.1MiB"``) is rounded down: a budget
    is an upper bound, so the byte below it is still within it. A fraction of a byte is an error.

    Raises:
        TypeError: ``value`` is neither int nor str (bools included).
        ValueError: the string does not parse, or the amount is not a positive whole byte count.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"memcompile option {key!r} must be an int number of bytes or a string like '6GiB'; "
            f"got {type(value).__name__} {value!r}"
        )
    if isinstance(value, int):
        n = value
    else:
        m = _BYTES_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"memcompile option {key!r}: cannot read {value!r} as a size; use bytes or a "
                "number with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                "(powers of 1024), e.g. '512MiB' or '6GB'"
            )
        # Exact arithmetic: float would turn "0.3GB" into 299999999.99999994 bytes.
        amount = Fraction(m.group(1)) * _UNITS[unit]
        if _UNITS[unit] == 1 and amount.denominator != 1:
            raise ValueError(f"memcompile option {key!r}: {value!r} is not a whole number of bytes")
        n = math.floor(amount)
    if n <= 0:
        raise ValueError(f"memcompile option {key!r} must be a positive size; got {value!r}")
    return n


def parse_fraction(value: str, *, key: str = "budget") -> float | None:
    """The fraction a percentage such as ``"60%"`` gives (0.6); ``None`` for a string that is
    not one.

    Raises:
        ValueError: a percentage that is not a number in (0, 100].
    """
    text = value.strip()
    if not text.endswith("%"):
        return None
    try:
        percent = float(text[:-1])
    except ValueError:
        percent = math.nan
    if not 0 < percent <= 100:  # nan fails both
        raise ValueError(
            f"memcompile option {key!r}: {value!r} is not a percentage in (0, 100]; a percentage "
            "budget is that share of the peak an iteration without a plan measures, e.g. '60%'"
        )
    return percent / 100


def _nearest_existing_dir(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _check_writable_path(key: str, value: Any, *, is_dir: bool) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"memcompile option {key!r} must be a path (str or os.PathLike) or None; "
            f"got {type(value).__name__}"
        )
    path = os.fspath(value)
    if not path:
        raise ValueError(f"memcompile option {key!r} must not be an empty path")
    if os.path.exists(path):
        if is_dir and not os.path.isdir(path):
            raise ValueError(f"memcompile option {key!r}: {path!r} exists and is not a directory")
        if not is_dir and os.path.isdir(path):
            raise ValueError(f"memcompile option {key!r}: {path!r} is a directory, not a file")
        target = path if is_dir else os.path.dirname(os.path.abspath(path))
    else:
        target = _nearest_existing_dir(
            os.path.dirname(os.path.abspath(path)) if not is_dir else path
        )
        if not os.path.isdir(target):
            raise ValueError(
                f"memcompile option {key!r}: {target!r} (parent of {path!r}) is not a directory"
            )
    if not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(f"memcompile option {key!r}: {path!r} is not writable")
    return path


def _choice(key: str, value: Any, choices: tuple[Any, ...]) -> Any:
    # `True in ("auto", True, False)` is fine, but 1 == True would sneak in: compare types too.
    for c in choices:
        if type(value) is type(c) and value == c:
            return value
    shown = ", ".join(repr(c) for c in choices)
    raise ValueError(f"memcompile option {key!r} must be one of {shown}; got {value!r}")


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"memcompile option {key!r} must be True or False; got {value!r}")
    return value


@dataclass(frozen=True)
class MemConfig:
    """Validated options of one ``torch.compile(..., backend="memcompile")`` call.

    Build it with :meth:`from_options`; the constructor does not validate.
    See DESIGN.md's option table for the meaning of each field.
    """

    budget: int | None = None
    #: ``budget="60%"``: this fraction of the peak of an iteration run without a plan, measured
    #: once the loop runs (``step/fraction.py``); ``budget`` is ``None`` until then.
    budget_fraction: float | None = None
    recompute: bool = True
    swap: bool = True
    reorder: bool = True
    offload_to: Literal["host", "disk"] = "host"
    disk_path: str | None = None
    offload_params: Literal["auto"] | bool = "auto"
    #: Optimizer state (Adam's moments, SGD's momentum) in the host tier (``step/iteration.py``):
    #: ``"auto"`` when the iteration does not fit with it on the device, ``True`` always.
    offload_optimizer: Literal["auto"] | bool = "auto"
    pilot: Literal["auto", "lightgbm", "markov", "off"] = "auto"
    prefetch_depth: int = 2
    #: The compiler of the rewritten graphs: ``"eager"`` runs them as planned, bit-identical to
    #: eager PyTorch; ``"inductor"`` is Inductor (its tolerance; its code measured and planned
    #: around); ``"auto"``: Inductor for a CUDA fragment where Triton is there, else eager
    #: (:func:`resolve_inner`, per fragment: ``FragmentRecord.inner`` says which ran).
    inner: Literal["auto", "eager", "inductor"] = "auto"
    device_profile: str = "auto"
    on_infeasible: Literal["error", "best_effort"] = "error"
    trace_path: str | None = None
    #: Give each read of a parameter that a fragment reads several times its own gradient edge
    #: (``rewrites/input_uses.py``), so its gradient adds up in eager's order also when the
    #: fragment runs several times a step or another fragment reads the weight too. Off by
    #: default: the fragment's backward then returns one gradient per read at once (an unrolled
    #: recurrence: one per time step); memcompile warns where the summed order differs.
    split_param_reads: bool = False
    #: FSDP2 models: before each ``fully_shard`` unit's forward the ranks compare which unit
    #: they are about to run (one small gloo all-gather on a group of memcompile's own) and raise
    #: ``RankDivergenceError`` when they differ, where FSDP's all-gathers would hang or abort
    #: (``backends/sharded.py``). Off by default: one collective per unit per forward.
    check_ranks: bool = False

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | MemConfig | None = None) -> MemConfig:
        """Validate ``options`` (as given to ``torch.compile(options=...)``) into a config.

        Raises:
            TypeError: ``options`` is not a mapping, or a value has the wrong type.
            ValueError: an unknown key, or a value out of range; the message names the key.
            NotImplementedError: the value needs a feature that has not landed yet.
        """
        if options is None:
            options = {}
        if isinstance(options, MemConfig):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"memcompile options must be a dict; got {type(options).__name__}")
        # budget_fraction is what budget="60%" becomes, not an option of its own.
        names = [f.name for f in dataclasses.fields(cls) if f.name != "budget_fraction"]
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = (
                    f"; did you mean {close[0]!r}?"
                    if close
                    else f"; valid options: {', '.join(names)}"
                )
                raise ValueError(f"unknown memcompile option {key!r}{hint}")
        o = dict(options)
        budget = o.get("budget")
        prefetch_depth = o.get("prefetch_depth", 2)
        if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int):
            raise TypeError(
                f"memcompile option 'prefetch_depth' must be an int; got {prefetch_depth!r}"
            )
        if prefetch_depth < 1:
            raise ValueError(
                f"memcompile option 'prefetch_depth' must be >= 1; got {prefetch_depth}"
            )
        device_profile = o.get("device_profile", "auto")
        if not isinstance(device_profile, str):
            raise TypeError(
                f"memcompile option 'device_profile' must be a string; got {device_profile!r}"
            )
        fraction = parse_fraction(budget) if isinstance(budget, str) else None
        cfg = cls(
            budget=None if budget is None or fraction else parse_bytes(budget, key="budget"),
            budget_fraction=fraction,
            recompute=_bool("recompute", o.get("recompute", True)),
            swap=_bool("swap", o.get("swap", True)),
            reorder=_bool("reorder", o.get("reorder", True)),
            offload_to=_choice("offload_to", o.get("offload_to", "host"), ("host", "disk")),
            disk_path=_check_writable_path("disk_path", o.get("disk_path"), is_dir=True),
            offload_params=_choice(
                "offload_params", o.get("offload_params", "auto"), ("auto", True, False)
            ),
            offload_optimizer=_choice(
                "offload_optimizer", o.get("offload_optimizer", "auto"), ("auto", True, False)
            ),
            pilot=_choice("pilot", o.get("pilot", "auto"), ("auto", "lightgbm", "markov", "off")),
            prefetch_depth=prefetch_depth,
            inner=_choice("inner", o.get("inner", "auto"), ("auto", "eager", "inductor")),
            device_profile=_choice("device_profile", device_profile, DEVICE_PROFILES),
            on_infeasible=_choice(
                "on_infeasible", o.get("on_infeasible", "error"), ("error", "best_effort")
            ),
            trace_path=_check_writable_path("trace_path", o.get("trace_path"), is_dir=False),
            split_param_reads=_bool("split_param_reads", o.get("split_param_reads", False)),
            check_ranks=_bool("check_ranks", o.get("check_ranks", False)),
        )
        cfg._check_landed()
        log.debug("memcompile config: %s", cfg)
        return cfg

    def _check_landed(self) -> None:
        # Values whose feature is a later issue: refuse loudly instead of ignoring them.
        pending: dict[str, tuple[bool, str]] = {}
        for key, (needs, feature) in pending.items():
            if needs:
                raise NotImplementedError(
                    f"memcompile option {key}={getattr(self, key)!r} needs {feature}, which is not "
                    "implemented in this version of memcompile"
                )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every option."""
        return dataclasses.asdict(self)


def resolve_inner(
    inner: Literal["auto", "eager", "inductor"], device_type: str | None
) -> Literal["eager", "inductor"]:
    """The inner compiler a fragment on a device of ``device_type`` (``"cuda"``, ``"cpu"``;
    ``None``: no tensor input) runs with: ``inner`` itself, or for
    ``"auto"`` Inductor on a CUDA device where Triton is installed (it is what makes Inductor
    fast there) and eager kernels elsewhere (on the CPU, Inductor's code was measured no faster
    under a budget, and a first compile costs ~45 s)."""
    if inner != "auto":
        return inner
    if device_type != "cuda":
        return "eager"
    from torch.utils._triton import has_triton

    return "inductor" if has_triton() else "eager"
