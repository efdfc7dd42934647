"""The uniform decode step (every row one new token after a cached context): its slot layout,
chunks and CUDA-graph capture (:mod:`.step`), the layouts kept from the last step (:mod:`.lanes`),
and the static buffers and two-level cascade attention a graph replays (:mod:`.cascade`)."""
