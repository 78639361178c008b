"""The protobuf bodies (postrain.actors.tinker.wire) round-trip through the tinker SDK's own codecs."""
import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from postrain.actors.tinker.errors import TinkerAPIError
from postrain.actors.tinker.wire import (WireSequence, decode_forward_backward, encode_forward_backward_output,
                                         encode_sample_response)


def test_a_forward_backward_request_decodes_as_the_sdk_encoded_it():
    data = [types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                                             types.EncodedTextChunk(tokens=[3])]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 0.5, 1.0]}),
            types.Datum(model_input=types.ModelInput.from_ints([7]),
                        loss_fn_inputs={"target_tokens": [8], "logprobs": [-1.5], "advantages": [2.0]})]
    request = types.ForwardBackwardRequest(model_id="s:train:0", seq_id=7, forward_backward_input=types.
                                           ForwardBackwardInput(data=data, loss_fn="ppo",
                                                                loss_fn_config={"clip_low_threshold": 0.9}))
    call = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 7, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.9)}
    assert call.datums[0].tokens.tolist() == [1, 2, 3]
    assert call.datums[0].inputs["target_tokens"].tolist() == [2, 3, 4]
    np.testing.assert_array_equal(call.datums[0].inputs["weights"], [0.0, 0.5, 1.0])
    assert call.datums[1].inputs["advantages"].tolist() == [2.0]


def test_outputs_and_samples_decode_in_the_sdk():
    outputs = [{"logprobs": np.array([-1.0, -2.0], np.float32), "elementwise_loss": np.array([0.5, 0.0], np.float32)},
               {"logprobs": np.array([-3.0], np.float32), "elementwise_loss": np.array([1.0], np.float32)}]
    decoded = deserialize_forward_backward_output(encode_forward_backward_output(outputs, {"loss:sum": 1.5}))
    assert decoded.metrics == {"loss:sum": 1.5}
    assert [o["logprobs"].data for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    sample = deserialize_sample_response(encode_sample_response(
        [WireSequence([5, 6], [-0.5, -0.25], "stop"), WireSequence([7], [-1.0], "length")],
        np.array([np.nan, -2.0], np.float32)))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([5, 6], [-0.5, -0.25], "stop"), ([7], [-1.0], "length")]
    assert sample.prompt_logprobs == [None, -2.0]


def test_a_body_that_is_not_a_request_is_refused_by_name():
    with pytest.raises(TinkerAPIError, match="not a ForwardBackwardRequest protobuf"):
        decode_forward_backward(b"\x0a\xff\xff\xff")
