"""Measuring and explaining: sweeps (:mod:`.sweep`), the acceptance report (:mod:`.report`), speclab vs
Hugging Face (:mod:`.compare`), the cost model (:mod:`.costmodel`) and ``speclab bench`` (:mod:`.cli`)."""
