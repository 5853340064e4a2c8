"""What the drafters and the engine share below them: feeding token chunks through a model and its
cache (feed), and a model's fixed-shape steps on a persistent cache, replayed from CUDA graphs
(graphs)."""
