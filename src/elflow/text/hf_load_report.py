"""Loading a Hugging Face encoder's weights quietly and strictly: transformers' weight-loading
report is held back, and what matters in it (missing, misshapen or foreign weights) is refused in
one line (:func:`refuse_bad_weights`)."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Mapping

from elflow.errors import ELFError

_UNUSED_KEY = re.compile(r"(^|\.)pooler\.")
"""Weights a checkpoint may lack without harm: ELF reads the hidden states, never the pooler
(a BERT checkpoint saved without it loads with a freshly initialised one)."""


_HELD = threading.local()


class _HoldLoadReport(logging.Filter):
    """Holds back transformers' weight-loading report in a thread that asked for it (see
    :func:`quiet_load_report`); every other record, and every other thread's, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        held = getattr(_HELD, "records", None)
        if held is None or "LOAD REPORT" not in str(record.msg):
            return True
        held.append(record)
        return False


_LOAD_LOG = logging.getLogger("transformers.modeling_utils")
_LOAD_LOG.addFilter(_HoldLoadReport())  # installed once; it acts only inside the context below


@contextlib.contextmanager
def quiet_load_report():
    """transformers' weight-loading report held back in this thread: what matters in it
    (missing, misshapen or foreign weights) is checked and refused in one line instead, and
    unused pooler weights are no news. If loading raises, the report is logged after all (the
    error points to it). A filter, not a logger level: transformers runs extra checks, and
    warns, when that logger's level is raised."""
    _HELD.records = held = []
    try:
        yield
    except BaseException:
        _HELD.records = None
        for record in held:
            _LOAD_LOG.handle(record)
        raise
    finally:
        _HELD.records = None


def _few(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")


def refuse_bad_weights(info: Mapping, name: str, t5: bool) -> None:
    """One line for weights the model lacks, weights of the wrong shape, or (a T5-family stack)
    encoder blocks the loading class has no place for."""
    where = f"the encoder weights of '{name}'"
    missing = [k for k in info.get("missing_keys", ()) if not _UNUSED_KEY.search(k)]
    if missing:
        raise ELFError(
            f"{where} lack {len(missing)} of the model's tensors ({_few(missing)}); "
            "they are another model's or incomplete"
        )
    mismatched = sorted(info.get("mismatched_keys", ()))
    if mismatched:
        key, theirs, ours = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise ELFError(
            f"{where} do not fit its config: {key} is {list(theirs)} in the checkpoint and "
            f"{list(ours)} in the model{more}"
        )
    foreign = [k for k in info.get("unexpected_keys", ()) if t5 and k.startswith("encoder.")]
    if foreign:
        raise ELFError(
            f"{where} hold {len(foreign)} encoder tensors the model has no place for "
            f"({_few(foreign)}); the checkpoint is of another architecture than its config says"
        )
