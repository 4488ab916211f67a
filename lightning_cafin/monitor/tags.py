"""TensorBoard tag names (all under ``cafin/``) and the custom-scalars dashboard that groups them."""

from __future__ import annotations

TAGS = {
    "step_ms": "cafin/step_ms",
    "step_ms_max": "cafin/step_ms_max",
    "baseline_step_ms": "cafin/baseline_step_ms",
    "capture_ms": "cafin/capture_ms",
    "divergence_max_abs": "cafin/divergence_max_abs",
    "divergence_rel": "cafin/divergence_rel",
    "memory_saved_mb": "cafin/memory_saved_mb",
    "skipped_steps": "cafin/skipped_steps",
    "modules_not_fired": "cafin/modules_not_fired",
    "params_f_one": "cafin/params_f_one",
    "backend": "cafin/backend",
}


def tag(key: str, suffix: str = "") -> str:
    """The tag for ``key``; ``suffix`` tells several optimizers apart (``/opt1`` ...)."""
    return TAGS[key] + suffix


def custom_scalars_layout(suffixes: list[str]) -> dict:
    """One 'CAFIN' page: latency, divergence, memory and health charts."""
    def lines(*keys):
        return ["Multiline", [tag(k, s) for k in keys for s in suffixes]]

    return {
        "CAFIN": {
            "step latency (ms)": lines("step_ms", "step_ms_max", "baseline_step_ms"),
            "factor capture cost (ms)": lines("capture_ms"),
            "fused vs baseline divergence": lines("divergence_max_abs", "divergence_rel"),
            "temporary memory saved per update (MB)": lines("memory_saved_mb"),
            "health": lines("skipped_steps", "modules_not_fired", "params_f_one"),
        }
    }
