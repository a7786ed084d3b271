"""Pure FX passes of graphshard: GraphModule (+ context) -> GraphModule.

No process group and no global state here: every pass can be run and tested on a hand-built or
captured graph in one process.
"""
