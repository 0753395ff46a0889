"""Generation: :class:`ELFPipeline` (``pipeline.py``), sample records on one process or many
(``records.py``, what ``elflow sample`` and every sweep cell write), infilling templates and
length control over a model (``infill.py``; the maths is :mod:`elflow.sampling.infill_maths`), text
likelihoods (``likelihood.py``; the maths is :mod:`elflow.sampling.likelihood_maths`), trajectory pages
(``trajectory.py``) and the shipped demo model (``demo.py``)."""
