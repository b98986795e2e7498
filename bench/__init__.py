"""Measurement, outside the installed package (see bench/README.md): the suite driver every suite runs on
(:mod:`.driver`: points, a pool per world size, records, JSON and Markdown), the suites ``core``
(:mod:`.core`), ``grid`` (:mod:`.grid`: strategies and peers, adapters in :mod:`.peers`), ``maxlen``
(:mod:`.maxlen`), ``masks`` (:mod:`.masks`), ``infer`` (:mod:`.infer`), ``train`` (:mod:`.train`,
:mod:`.train_maxlen`), ``hf`` (:mod:`.hf`), ``partition`` and ``dispatch``; the ``torch.distributed`` byte
meter of the peers (:mod:`.distmeter`), plots (:mod:`.plots`), the Markdown writer (:mod:`.report`), the
emulated cluster (:mod:`.cluster`) and one-off scripts (:mod:`.scripts`). The command: :mod:`.cli`
(``python -m bench ...``; ``burstattn bench ...`` forwards here from a source checkout).

The meters the package's own commands use live in :mod:`burstattn.meter`. Nothing is imported here.
"""
