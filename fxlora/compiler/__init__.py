"""The graph toolkit the passes (:mod:`fxlora.passes`) are written with, and the machinery
around them.

For the passes: what they share (:mod:`.context`: the pool, the arena, the records of what
they did), what a traced call is and which module made it (:mod:`.module_tree`,
:mod:`.calls`), graph-editing steps (:mod:`.graph_edit`), which dimension of an input holds
the batch's rows (:mod:`.rows`), a LoRA op's operands as graph nodes (:mod:`.operands`), and
the proof an experts region needs (:mod:`.experts_probe`). Around them: the arena that
hoisted allocations live in (:mod:`.arena`), the inner compiler that runs each variant
(:mod:`.inner`, :mod:`.regions`), the traceable forwards of experts no transformers
implementation serves (:mod:`.experts_op`) and the progress bar (:mod:`.progress`). Nothing here imports a
pass.
"""
