"""``wrap()``: convert an existing model in place to tp-fuse's sharded layers (``convert``),
the modules it puts in place (``modules``), its report (``report``), plan styles and the
built-in Hugging Face plans.
"""
