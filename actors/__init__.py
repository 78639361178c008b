"""postrain.actors"""
