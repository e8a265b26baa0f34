"""The checker's own recomputation of a run: its schedule (which stored microbatch is
position ``m`` of step ``s``, and which trainer of a quorum runs it), its data reader (the
training store's microbatches as the trainers feed them to the model and the shards), and
what is built on them. Written here from the run's files and the product's documented
semantics, never imported from the product: a recomputation that shared the product's code
would share its bugs. The modules are imported by name (``verify.replay.schedule``, ...):
this package loads none of them on its own.
"""
