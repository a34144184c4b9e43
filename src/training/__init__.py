"""What a model is trained with: datasets and their files, the model registry, optimizers, learning-rate schedules."""
