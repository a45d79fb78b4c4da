"""The XLA forms of the families: the state-space core's algebra (``ssm``) and its recurrence
and scan (``ssm_forms``), the HLA drivers (``hla_forms``), and the chunked forms
(``la_chunked``, ``gdn_chunked``, ``loglinear_blocks``, ``loglinear_gdn_blocks``,
``loglinear_chunked``)."""
