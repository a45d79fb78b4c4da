"""The leaf layer every other part of hla_jax builds on: input checks (``checks``), documents and
positions of packed rows (``documents``), chunk and buffer layouts (``layout``), the block forms'
chunk levels (``block_levels``), decode-state types (``state``), the Fenwick levels
(``fenwick``) and errors as one line (``errors``).  It imports nothing else of hla_jax."""
