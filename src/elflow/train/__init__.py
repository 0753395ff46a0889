"""Training: run configs and presets, run set-up, the loop, reporting, resume and distillation.

``train(cfg, out)`` trains or resumes a run (``loop.py``); ``preset(name)`` and
``apply_overrides(cfg, file, sets)`` build its config (``presets.py``, ``config.py``);
``distill(...)`` runs the progressive-distillation curriculum (``curriculum.py``, spec §8).
"""

from elflow.runtime.lazy_exports import lazy_exports

__all__ = ["RunConfig", "apply_overrides", "distill", "preset", "train"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "RunConfig": "elflow.config.train_config",
        "apply_overrides": "elflow.config.train_config",
        "distill": "elflow.distill.curriculum",
        "preset": "elflow.config.run_presets",
        "train": "elflow.train.loop",
    },
)
