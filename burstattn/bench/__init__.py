"""Benchmarks and measuring tools: ``burstattn bench core`` (:mod:`.core`), the peak-memory meter
(:mod:`.memory`), timing and machine information (:mod:`.timing`), the progress display shared with
``burstattn demo`` (:mod:`.progress`) and the Markdown writer (:mod:`.report`).

Nothing is imported here: ``import burstattn`` stays light.
"""
