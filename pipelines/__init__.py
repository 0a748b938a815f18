"""What the library serves: model families, offline builders, the generation core and its two
front ends (``bcg-generate`` and ``bcg-serve``). It reaches ``accel`` through its public names
only, and ``accel`` never imports it (docs/design.md, "Layers").

Packages:

families           one folder per model family (recipe, released configs, generation
                   defaults, compiled forms), and the catalog of which models exist
releases           the built-in models' released configs, read from each family's ``release``
zoo                diffusers pipelines at their released denoiser configs, for breadth benchmarks
generation         the generation core: model flags and settings, the pipeline prepared, a call's
                   settings, the pipeline call, each image's record and bytes
stepwise           a pipeline's denoising loop run a step at a time, for a running batch that
                   requests join and leave at step boundaries (the server's continuous batching)
cli                ``bcg-generate``, a front end over the generation core
serve              ``bcg-serve``, the other front end: an HTTP server that keeps its graphs warm

Modules:

lazy               a package's names imported on first use, so that importing it imports none
construction       modules created in place with random weights, seeded
tokenizer          an offline Qwen2-style tokenizer for the random-weight pipelines
tokenizers_t5_clip offline CLIP and T5 tokenizers for the random-weight FLUX.1 and Wan2.1 pipelines
builders           the built-in models built offline with random weights, or from_pretrained
limits             how far a generation request may go, each limit derived from the model or machine
memory_estimate    the activation memory of one pipeline call, estimated before it runs
lora               LoRA adapters from ``.safetensors`` files, loaded by diffusers itself
"""
