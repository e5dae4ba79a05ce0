"""What a run trains: the model table and builders (built-in, torchvision, timm, custom), the GPT, and the task (its loss and its primary metric)."""
