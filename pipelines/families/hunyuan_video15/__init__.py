"""HunyuanVideo-1.5: a recipe only (no built-in model: it runs from a hub id or a local folder).

models    ``FAMILY``: no built-in model; how its pipeline is run
recipe    :class:`~pipelines.families.hunyuan_video15.recipe.HunyuanVideo15Recipe` (the condition tokens' break)
"""
