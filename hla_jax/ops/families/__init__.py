"""The operator families, one module each: its ``Spec`` (``SPECS``), its algebra (decode state,
``step``, token summaries, ``combine``, ``readout``) and its public entries."""
