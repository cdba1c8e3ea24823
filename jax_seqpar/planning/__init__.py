"""Layer 3, ``planning``: hardware descriptions, the predicted time and memory of every
way to split a layer (:mod:`.predict`), and the choice (:mod:`.plan`)."""
