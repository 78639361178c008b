"""postrain.core"""
