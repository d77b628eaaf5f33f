"""lm-evaluation-harness integration: the `MegatronLM` adapter (adapter.py), the entry point (evaluate.py) and
offline task definitions (local_tasks/). lm-eval is optional: `require_lm_eval()` names the fix when it is missing."""
from __future__ import annotations

from megatron.errors import MegatronUserError

LM_EVAL_HINT = 'pip install "lm-eval>=0.4,<0.5"'


class LmEvalMissing(MegatronUserError, ImportError):
    """lm-evaluation-harness is not installed."""


def require_lm_eval() -> None:
    """Raise a one-line error unless lm-eval >= 0.4 is importable."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM  # noqa: F401 - the 0.4 API
    except ImportError as exc:
        raise LmEvalMissing(f"the evaluation harness needs lm-evaluation-harness >= 0.4 ({exc}); "
                            f"install it with: {LM_EVAL_HINT}") from None
