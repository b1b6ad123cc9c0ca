"""Context parallelism: each sequence split over the cp ranks, attention over the whole of it.

    sequence.py   `ContextParallel`: the load-balanced split, attention by gathered K/V,
                  loss weights by counted labels
"""
