"""Measuring and explaining: sweeps (:mod:`.sweep`), the acceptance report (:mod:`.report`), speclab vs
Hugging Face (:mod:`.compare`), the cost model (:mod:`.costmodel`) and ``speclab bench`` (:mod:`.cli`);
the roofline of named hardware (:mod:`.roofline`), the advisor and ``speclab advise`` (:mod:`.advisor`),
its validation against published measurements (:mod:`.published`) and on this CPU (:mod:`.cpucheck`)."""
