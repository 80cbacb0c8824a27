"""Draft training: data, the hidden-state cache, objectives, checkpoints and resume, FR-Spec token maps."""
