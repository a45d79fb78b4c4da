"""The leaf layer every other part of hla_jax builds on: input checks (``checks``), documents and
positions of packed rows (``documents``), chunk and buffer layouts (``layout``), the block forms'
chunk levels (``block_levels``), decode-state types (``state``) and the Fenwick levels
(``fenwick``).  It imports nothing else of hla_jax."""
