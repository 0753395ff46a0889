"""Model files: elflow model folders (``artifact.py``, the public face; their config in
``artifact_config.py``, weight files in ``safetensors_files.py``, saving and loading for any
network class in ``model_folder.py``, ``from_pretrained`` in ``pretrained_mixin.py``), where a
model source's weights are (``model_sources.py``), training checkpoints (``checkpoint.py``) and
the authors' checkpoints (``official.py``, ELF_SPEC §7). Configs never import this."""
