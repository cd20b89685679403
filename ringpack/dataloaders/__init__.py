"""ringpack.dataloaders"""
