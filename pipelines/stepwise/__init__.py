"""A pipeline's denoising loop one step at a time, for a batch whose rows are at their own steps.

A row is one image: its text, latents, schedule and guidance. Rows join a running batch of a
fixed size (a batch-size bucket, whose graphs the warm-up captured) at a step boundary and leave
it when their steps are done; empty slots are padding, filled with a copy of a row, and read by
nobody. A row's arithmetic depends only on its own inputs and on the batch's shapes, so its image
is the one the stock pipeline makes of it in a call of the same batch size, whatever the other
rows are and whichever steps they are at. Text is encoded and latents decoded at the same batch
size for the same reason, unless the decoder is found to give every row the same bits at every
batch size (``invariance``): rows leaving together then decode at the smallest that holds them.
What a family's pipeline does in its loop is re-stated in its folder
(``pipelines/families/<family>/steps.py``); what is the same for every family is here.

schedule  a row's own scheduler and where it is; the scheduler's own ``step`` on its row
family    a pipeline's step loop, found in its family's folder; the pipeline call's bracket
batch     the running batch: rows in slots, one step for all of them; text and decode at a batch size
invariance  whether a family's decode gives each row the same bits at every batch size
"""

from __future__ import annotations

__all__: list[str] = []
