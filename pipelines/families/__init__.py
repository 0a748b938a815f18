"""The model families: one folder each, holding everything the project knows of that family.

A family folder (``pipelines/families/<family>/``) holds, each in its own module:

models    torch-free: ``FAMILY``, a :class:`~pipelines.families.records.Family` record with its
          built-in models (name, aliases, pipeline class, video or not) and the generation
          defaults its pipelines run at (steps, guidance, a video model's size and frames).
          Required: it is what makes the folder a family.
recipe    the ``accel.Recipe`` of its denoiser, found by accel through the one line in
          pyproject.toml's ``bcg_diffusers.recipes`` entry points that names it (a family the
          generic recipe serves has no recipe and no line)
release   ``RELEASES``: the released configs of its built-in models, as data
          (:class:`pipelines.releases.spec.Release`), read by :mod:`pipelines.releases`
forms     its compiled forms: code swapped in under ``compile=True`` (where it has any)
steps     its pipeline's denoising loop one step at a time, for a batch whose rows are at their own
          steps (``bcg-serve --batching continuous``; :mod:`pipelines.stepwise` finds it)

and an ``__init__`` docstring naming them. Nothing outside the folder lists a family:
:mod:`~pipelines.families.catalog` finds every package here and reads its ``models.FAMILY``, so
adding a family is one folder and, if it has a recipe, one entry-point line (docs/development.md,
"Adding a model family"). The modules of this package:

records   :class:`~pipelines.families.records.ModelRecord`, :class:`~pipelines.families.records.Family`
catalog   the one catalog: which models exist, by name and alias, read without torch

and the families:

flux             FLUX.1-dev (recipe, release, compiled forms)
flux2            FLUX.2 [klein] 4B and klein 9B KV (recipe, release)
hunyuan_video15  HunyuanVideo-1.5 (recipe only)
qwen_image       Qwen-Image, its edit pipelines and Qwen-Image Layered (recipe, release, forms)
qwen_image_21    Qwen-Image 2.1 (recipe, release)
wan              Wan2.1 14B and 1.3B (release only: the generic recipe serves it)
z_image          Z-Image and Z-Image Omni (recipe, release)
"""
