"""DCP, torchtitan, Lightning, Accelerate, the HF Trainer, framework trees."""
