"""Layer 3, ``planning``: hardware descriptions, the predicted time and memory of every
way to split a layer (:mod:`.predict`, the one time model), the choice (:mod:`.plan`),
tuned plans (:mod:`.tuned`) and the model's rows for large meshes (:mod:`.projection`)."""

__all__: list[str] = []
