"""The library behind the evidence: a comparison of arms and its learning-rate
sweep (:mod:`.compare`), the record it writes and its checks (:mod:`.compare_file`),
and the pre-registered verdict rule (:mod:`.verdict`). ``launch/compare.py`` and
``launch/verdict.py`` only parse flags and call them."""
