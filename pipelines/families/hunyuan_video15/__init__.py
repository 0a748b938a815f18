"""HunyuanVideo-1.5: a recipe only (no built-in model: it runs from a hub id or a local folder).

recipe    :class:`~pipelines.families.hunyuan_video15.recipe.HunyuanVideo15Recipe` (the condition tokens' break)
"""
