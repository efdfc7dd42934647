"""The uniform decode step (every row one new token after a cached context): its slot layout and
chunks (:mod:`.step`, laid out from the last step's rows: :mod:`..plan.lanes`), the static
buffers and two-level cascade attention a graph replays (:mod:`.cascade`), and the CUDA graphs,
one per bucket, each checked at its first replay (:mod:`.graphs`)."""
