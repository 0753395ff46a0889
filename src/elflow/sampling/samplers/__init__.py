"""The built-in samplers, one module each (named as the sampler): its spec, its rank in listings
and its step maths. :mod:`elflow.sampling.registry` finds them by listing this folder; a module
imports torch only when its step runs."""
