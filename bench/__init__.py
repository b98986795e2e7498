"""Benchmarks and measuring tools: the suite driver every suite runs on (:mod:`.driver`: points, a pool
per world size, records, JSON and Markdown), ``burstattn bench core`` (:mod:`.core`), ``bench grid``
(:mod:`.grid`: strategies and peers, adapters in :mod:`.peers`), ``bench maxlen`` (:mod:`.maxlen`),
``bench masks`` (:mod:`.masks`), ``bench infer`` (:mod:`.infer`), ``bench train`` (:mod:`.train`),
``bench hf`` (:mod:`.hf`), the demo's job (:mod:`.demo`), the
``torch.distributed`` byte meter (:mod:`.distmeter`), plots (:mod:`.plots`), the peak-memory meter
(:mod:`.memory`), timing and machine information (:mod:`.timing`), the progress display shared with
``burstattn demo`` (:mod:`.progress`) and the Markdown writer (:mod:`.report`).

Nothing is imported here: ``import burstattn`` stays light.
"""
