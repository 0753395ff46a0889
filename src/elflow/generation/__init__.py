"""Generation: :class:`ELFPipeline` (``pipeline.py``; its checks in ``request_checks.py``, saving
in ``model_folder.py``) and what it returns (``outputs.py``); the one path from rows to text
(``engine.py``, graph-captured steps in ``cuda_graphs.py``); sample records on one process or many
(``records.py``, what ``elflow sample`` and every sweep cell write; ``partial.py``); infilling
templates and length control (``infill.py``, read back by ``infill_texts.py``; the maths is
:mod:`elflow.sampling.infill_maths`); text likelihoods (``likelihood.py``; the maths is
:mod:`elflow.sampling.likelihood_maths`), trajectory pages (``trajectory.py``) and the shipped
demo model (``demo_loader.py``)."""
