"""postrain.ext"""
