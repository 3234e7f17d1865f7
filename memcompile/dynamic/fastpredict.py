"""LightGBM's single-row fast prediction path, through ctypes.

``Booster.predict`` spends ~20–35 µs in Python per call whatever the model size (research/04
§Q3); the C API's ``LGBM_BoosterPredictForMatSingleRowFast`` with a configuration prepared once
(``...FastInit``) predicts a ~100-tree model in a few µs. This wraps it:

    fast = FastBooster(booster)          # prepares the fast configuration once
    fast.row[:] = features               # a preallocated float64 row
    probs = fast.predict()               # numpy view of the preallocated output (class probs)

The output array is reused by the next call: copy it to keep it. Calls release the GIL (ctypes),
and each :class:`FastBooster` has its own buffers: use one per thread. Several boosters over the
same features can share one input row (``FastBooster(b, row=x)``): the pilot writes a feature row
once and every horizon's booster reads it. :meth:`FastBooster.best` returns the argmax class and
its probability without a numpy round trip per call site. :meth:`FastBooster.best_of` reads the
row from a ``bytes`` object instead (``struct.pack`` of the float64 values, native order): ctypes
hands the C call a pointer into the bytes, so a caller that packs the row anyway (the pilot uses
the bytes as its answer-cache key) copies it into no buffer:

    key = struct.pack(f"{n}d", *features)   # 0.5 µs for 49 floats; a list into a buffer: 1.1 µs
    i, p = fast.best_of(key)
"""

from __future__ import annotations

import ctypes
import logging

import lightgbm as lgb
import numpy as np
from lightgbm.basic import _LIB, _safe_call

log = logging.getLogger(__name__)

__all__ = ["FastBooster"]

_C_API_DTYPE_FLOAT64 = 1
_C_API_PREDICT_NORMAL = 0


class FastBooster:
    """Single-row predictions of ``booster`` through LightGBM's fast C path.

    Args:
        booster: a trained booster (kept alive by this object).
        row: the input buffer to read (float64, C-contiguous, one value per feature), shared
            with other boosters over the same features; ``None``: a new one.

    Attributes:
        row: the input row (float64, one value per feature; NaN is "missing").
        out: the output of the last :meth:`predict` (class probabilities, or one value).
        nbytes: the size of a packed row (:meth:`best_of`): 8 bytes per feature.
        c_predict, c_config, c_out_len, c_out: the C call of :meth:`best_of`, for a caller
            that inlines it (see ``__init__``).
    """

    def __init__(self, booster: lgb.Booster, *, row: np.ndarray | None = None) -> None:
        self.booster = booster
        ncol = booster.num_feature()
        num_class = ctypes.c_int(0)
        _safe_call(_LIB.LGBM_BoosterGetNumClasses(booster._handle, ctypes.byref(num_class)))
        classes = num_class.value
        if row is None:
            row = np.zeros(ncol, dtype=np.float64)
        elif row.dtype != np.float64 or row.shape != (ncol,) or not row.flags.c_contiguous:
            raise ValueError(
                f"FastBooster: row must be a C-contiguous float64 array of shape ({ncol},); "
                f"got {row.dtype} {row.shape}"
            )
        self.row = row
        self.out = np.zeros(classes, dtype=np.float64)
        self._row_ptr = self.row.ctypes.data_as(ctypes.c_void_p)
        self._out_ptr = self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        self.nbytes = 8 * ncol
        self._out_len = ctypes.c_int64(0)
        self._out_len_ref = ctypes.byref(self._out_len)
        self._config = ctypes.c_void_p()
        _safe_call(
            _LIB.LGBM_BoosterPredictForMatSingleRowFastInit(
                booster._handle,
                ctypes.c_int(_C_API_PREDICT_NORMAL),
                ctypes.c_int(0),  # start iteration
                ctypes.c_int(-1),  # all iterations
                ctypes.c_int(_C_API_DTYPE_FLOAT64),
                ctypes.c_int32(ncol),
                ctypes.c_char_p(b"num_threads=1"),
                ctypes.byref(self._config),
            )
        )
        self._predict = _LIB.LGBM_BoosterPredictForMatSingleRowFast
        self._args = (self._config, self._row_ptr, self._out_len_ref, self._out_ptr)
        # The C call's pieces, for a hot path that inlines :meth:`best_of` (the pilot's
        # predict: a method call and its checks cost ~0.4 µs of a ~1.4 µs call):
        # ``c_predict(c_config, data, c_out_len, c_out)`` fills :attr:`out` from the packed
        # ``data`` (exactly ``8 * num_feature`` bytes: the C side reads that many) and returns
        # nonzero on error (see :meth:`raise_last_error`).
        self.c_predict = self._predict
        self.c_config, self.c_out_len, self.c_out = self._config, self._out_len_ref, self._out_ptr

    def predict(self) -> np.ndarray:
        """Predict :attr:`row`; returns :attr:`out` (overwritten by the next call)."""
        if self._predict(*self._args) != 0:
            raise lgb.basic.LightGBMError(_LIB.LGBM_GetLastError().decode("utf-8"))
        return self.out

    def best(self) -> tuple[int, float]:
        """Predict :attr:`row`: the most probable class index (the first on ties, as
        ``argmax``) and its probability."""
        if self._predict(*self._args) != 0:
            raise lgb.basic.LightGBMError(_LIB.LGBM_GetLastError().decode("utf-8"))
        out = self.out
        i = int(out.argmax())
        return i, out.item(i)

    def best_of(self, data: bytes) -> tuple[int, float]:
        """Like :meth:`best`, for the row packed in ``data`` (float64, native byte order, one
        value per feature) instead of :attr:`row`, which is left as it is.

        Raises:
            ValueError: ``data`` is not ``8 * num_feature`` bytes (the C call would read past it).
        """
        if type(data) is not bytes or len(data) != self.nbytes:
            raise ValueError(
                f"FastBooster.best_of: data must be {self.nbytes} bytes (float64 per feature); "
                f"got {type(data).__name__} of {len(data) if isinstance(data, bytes) else '?'}"
            )
        # ctypes passes a bytes argument as a pointer to its (immutable) buffer: no copy
        if self._predict(self._config, data, self._out_len_ref, self._out_ptr) != 0:
            raise lgb.basic.LightGBMError(_LIB.LGBM_GetLastError().decode("utf-8"))
        out = self.out
        i = int(out.argmax())
        return i, out.item(i)

    @staticmethod
    def raise_last_error() -> None:
        """Raise LightGBM's error of the last failed C call (:attr:`c_predict` returned
        nonzero)."""
        raise lgb.basic.LightGBMError(_LIB.LGBM_GetLastError().decode("utf-8"))

    def __del__(self) -> None:
        config = getattr(self, "_config", None)
        if config is not None and config.value:
            _LIB.LGBM_FastConfigFree(config)
            config.value = None
