"""What the training scripts do, as a library: build a model from the user's choices, prepare the data of each
objective and fine-tuning task, train with checkpoints that are complete or absent, save the final folder with its
loss curve and model card, sample from it, push it to the Hub, and measure models side by side.

The scripts in `scripts/` parse arguments and call these modules. Nothing here is imported by `import archlab`:
each module is imported when a script (or your code) needs it.
"""
