"""The model families: one folder each, holding everything the project knows of that family.

A family folder (``pipelines/families/<family>/``) holds, each in its own module:

recipe    the ``accel.Recipe`` of its denoiser, found by accel through the ``bcg_diffusers.recipes``
          entry point that names it (a family the generic recipe serves has none)
release   its released configs as data (``pipelines.releases.spec.Release``), one per built-in model
forms     its compiled forms: code swapped in under ``compile=True`` (a family with none has none)
"""
