"""Few-step students (ELF_SPEC §11): progressive distillation, consistency distillation, their
registry and the training curriculum."""
