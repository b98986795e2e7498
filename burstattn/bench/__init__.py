"""Benchmarks and measuring tools: ``burstattn bench core`` (:mod:`.core`), ``bench grid`` (:mod:`.grid`:
strategies and peers, adapters in :mod:`.peers`), ``bench maxlen`` (:mod:`.maxlen`), the
``torch.distributed`` byte meter (:mod:`.distmeter`), plots (:mod:`.plots`), the peak-memory meter
(:mod:`.memory`), timing and machine information (:mod:`.timing`), the progress display shared with
``burstattn demo`` (:mod:`.progress`) and the Markdown writer (:mod:`.report`).

Nothing is imported here: ``import burstattn`` stays light.
"""
