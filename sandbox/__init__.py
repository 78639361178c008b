"""postrain.sandbox"""
