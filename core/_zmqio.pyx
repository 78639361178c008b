# cython: language_level=3, boundscheck=False, wraparound=False
"""Non-blocking ZeroMQ send and receive in C, on sockets that pyzmq created.

The message path calls libzmq here, not through pyzmq's Python-level calls,
which cost several times more per frame than the C calls they wrap (a
getsockopt through pyzmq: ~2 us; here: a few hundred ns). The functions come
from the libzmq that pyzmq itself loaded (`bind(path)` opens that file with
RTLD_NOLOAD, so there is never a second copy of libzmq in the process), and
they take the pyzmq socket, whose C handle (`underlying`) is used only
while pyzmq says the socket is open.

Frames received: `bytes` below COPY_BELOW_BYTES; larger ones stay in
ZeroMQ's memory as a `ReceivedFrame` (read-only buffer protocol, freed with
the last view). Frames sent: `send_frames` copies `bytes` frames below
COPY_BELOW_BYTES and leaves any message with another frame to pyzmq's
zero-copy send (it returns None).
"""
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stddef cimport size_t
from libc.stdint cimport uintptr_t

cdef extern from "dlfcn.h" nogil:
    void *dlopen(const char *filename, int flags)
    void *dlsym(void *handle, const char *symbol)
    int RTLD_NOW
    int RTLD_NOLOAD

cdef extern from "errno.h":
    int EAGAIN
    int ENOTSOCK

cdef extern from *:
    """
    typedef struct { unsigned char _[64] __attribute__((aligned(sizeof(void *)))); } zmqio_msg_t;
    """
    ctypedef struct zmqio_msg_t:
        pass

ctypedef int (*msg_init_fn)(zmqio_msg_t *) nogil
ctypedef int (*msg_recv_fn)(zmqio_msg_t *, void *, int) nogil
ctypedef void *(*msg_data_fn)(zmqio_msg_t *) nogil
ctypedef size_t (*msg_size_fn)(const zmqio_msg_t *) nogil
ctypedef int (*msg_more_fn)(const zmqio_msg_t *) nogil
ctypedef int (*msg_close_fn)(zmqio_msg_t *) nogil
ctypedef int (*msg_move_fn)(zmqio_msg_t *, zmqio_msg_t *) nogil
ctypedef int (*send_fn)(void *, const void *, size_t, int) nogil
ctypedef int (*errno_fn)() nogil
ctypedef int (*getsockopt_fn)(void *, int, void *, size_t *) nogil

cdef msg_init_fn z_msg_init = NULL
cdef msg_recv_fn z_msg_recv = NULL
cdef msg_data_fn z_msg_data = NULL
cdef msg_size_fn z_msg_size = NULL
cdef msg_more_fn z_msg_more = NULL
cdef msg_close_fn z_msg_close = NULL
cdef msg_move_fn z_msg_move = NULL
cdef send_fn z_send = NULL
cdef errno_fn z_errno = NULL
cdef getsockopt_fn z_getsockopt = NULL

cdef enum:  # zmq.h's values, fixed by libzmq's ABI
    ZMQ_DONTWAIT = 1
    ZMQ_SNDMORE = 2
    ZMQ_EVENTS = 15

COPY_BELOW_BYTES = 1 << 16
cdef Py_ssize_t copy_below = COPY_BELOW_BYTES


cdef void *_symbol(void *lib, const char *name) except NULL:
    cdef void *fn = dlsym(lib, name)
    if fn == NULL:
        raise ImportError(f"libzmq has no symbol {name.decode()}")
    return fn


def bind(str path):
    """Take libzmq's functions from `path`, which must already be loaded (pyzmq's)."""
    global z_msg_init, z_msg_recv, z_msg_data, z_msg_size, z_msg_more, z_msg_close, z_msg_move
    global z_send, z_errno, z_getsockopt
    cdef bytes encoded = path.encode()
    cdef void *lib = dlopen(encoded, RTLD_NOW | RTLD_NOLOAD)
    if lib == NULL:
        raise ImportError(f"libzmq at {path} is not loaded in this process")
    z_msg_init = <msg_init_fn>_symbol(lib, b"zmq_msg_init")
    z_msg_recv = <msg_recv_fn>_symbol(lib, b"zmq_msg_recv")
    z_msg_data = <msg_data_fn>_symbol(lib, b"zmq_msg_data")
    z_msg_size = <msg_size_fn>_symbol(lib, b"zmq_msg_size")
    z_msg_more = <msg_more_fn>_symbol(lib, b"zmq_msg_more")
    z_msg_close = <msg_close_fn>_symbol(lib, b"zmq_msg_close")
    z_msg_move = <msg_move_fn>_symbol(lib, b"zmq_msg_move")
    z_send = <send_fn>_symbol(lib, b"zmq_send")
    z_errno = <errno_fn>_symbol(lib, b"zmq_errno")
    z_getsockopt = <getsockopt_fn>_symbol(lib, b"zmq_getsockopt")


cdef class ReceivedFrame:
    """A received frame of at least COPY_BELOW_BYTES, left in ZeroMQ's memory.
    Read-only; ZeroMQ frees it when the last view of it is gone."""

    cdef zmqio_msg_t msg
    cdef bint owns

    def __len__(self):
        return z_msg_size(&self.msg)

    def __getbuffer__(self, Py_buffer *view, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("a received frame is read-only")
        view.buf = z_msg_data(&self.msg)
        view.len = z_msg_size(&self.msg)
        view.readonly = 1
        view.itemsize = 1
        view.format = NULL
        view.ndim = 1
        view.shape = NULL
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL
        view.obj = self

    def __dealloc__(self):
        if self.owns:
            z_msg_close(&self.msg)


cdef _raise(int error):
    import zmq
    raise zmq.ZMQError(error)


cdef void *_handle(sock) except NULL:
    if sock._closed:
        _raise(ENOTSOCK)
    return <void *><uintptr_t>sock.underlying


def recv_message(sock):
    """The next whole message on the socket as a list of frames, or None if none is
    waiting. Never blocks."""
    cdef zmqio_msg_t msg
    cdef ReceivedFrame kept
    cdef list frames = []
    cdef Py_ssize_t size
    cdef int more = 1, error
    cdef void *handle = _handle(sock)
    while more:
        z_msg_init(&msg)
        if z_msg_recv(&msg, handle, ZMQ_DONTWAIT) < 0:
            error = z_errno()
            z_msg_close(&msg)
            if not frames and error == EAGAIN:
                return None
            _raise(error)  # a later frame of a message is always there at once
        more = z_msg_more(&msg)
        size = z_msg_size(&msg)
        if size < copy_below:
            frames.append(PyBytes_FromStringAndSize(<char *>z_msg_data(&msg), size))
            z_msg_close(&msg)
        else:
            kept = ReceivedFrame.__new__(ReceivedFrame)
            z_msg_init(&kept.msg)
            z_msg_move(&kept.msg, &msg)   # the frame object closes it
            kept.owns = True
            frames.append(kept)
    return frames


def send_frames(sock, list frames):
    """Send `frames` as one message if every frame is `bytes` below COPY_BELOW_BYTES:
    True if sent, False if the socket would block (nothing sent). None when a frame is
    not such (nothing sent; send it through pyzmq)."""
    cdef Py_ssize_t index, last = len(frames) - 1
    cdef object frame
    cdef void *handle = _handle(sock)
    for frame in frames:
        if type(frame) is not bytes or PyBytes_GET_SIZE(frame) >= copy_below:
            return None
    for index in range(last + 1):
        frame = frames[index]
        if z_send(handle, PyBytes_AS_STRING(frame), PyBytes_GET_SIZE(frame),
                  ZMQ_DONTWAIT | ZMQ_SNDMORE if index < last else ZMQ_DONTWAIT) < 0:
            if index == 0 and z_errno() == EAGAIN:
                return False
            _raise(z_errno())  # ZeroMQ takes the rest of a message it began
    return True


def events(sock):
    """ZMQ_EVENTS of the socket (POLLIN = 1, POLLOUT = 2)."""
    cdef int value = 0
    cdef size_t size = sizeof(int)
    if z_getsockopt(_handle(sock), ZMQ_EVENTS, &value, &size) < 0:
        _raise(z_errno())
    return value
