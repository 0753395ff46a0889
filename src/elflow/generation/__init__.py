"""Generation: :class:`ELFPipeline` (``pipeline.py``), sample records on one process or many
(``records.py``, what ``elflow sample`` and every sweep cell write), infilling templates and
length control (``infill.py``), text likelihoods (``likelihood.py``), trajectory pages
(``trajectory.py``) and the shipped demo model (``demo.py``)."""
