package container

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"sync"
)

// Frames: what travels on each stream between a microVM's shim and its
// guest's agent (vmm_linux.go, guest_linux.go). The two ends speak the
// init protocol of proto.go, but over a virtio-serial port, which passes
// bytes and no descriptors: one port carries a yamux session, and each
// request is a stream of its own, whose frames are a kind byte, a
// big-endian uint32 length and that many bytes.
//
//	shim                                       guest agent
//	  open a stream; frameRequest{op, id, ...} ─▶
//	  (exec) frameStdin ... frameStdinEOF ─────▶ into the command's stdin
//	                 ◀─ frameReply{id, pid}      started
//	                 ◀─ frameStdout, frameStderr its output, as it comes
//	                 ◀─ frameReply{id, exit}     ended: after every byte it
//	                                             wrote before it ended
//	                 ◀─ frameStdout ...          what its children write on
//	                                             until the pipes close; then
//	                                             the stream closes
//
// Other requests get their reply frames and the stream closes; the files
// request (opFiles) turns the rest of its stream into the file protocol
// (files_linux.go's remote half). Frames from the guest are untrusted:
// a length over maxFrame ends the stream.
const (
	frameRequest  = 'q'
	frameReply    = 'r'
	frameStdin    = '0'
	frameStdout   = '1'
	frameStderr   = '2'
	frameStdinEOF = 'e'
)

// maxFrame bounds a frame's payload.
const maxFrame = 1 << 20

// frameWriter writes whole frames to one stream from any goroutine.
type frameWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (fw *frameWriter) frame(kind byte, p []byte) error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	for { // a long write as frames of maxFrame; an empty one as one frame
		n := min(len(p), maxFrame)
		var hdr [5]byte
		hdr[0] = kind
		binary.BigEndian.PutUint32(hdr[1:], uint32(n))
		if _, err := fw.w.Write(hdr[:]); err != nil {
			return err
		}
		if _, err := fw.w.Write(p[:n]); err != nil {
			return err
		}
		if p = p[n:]; len(p) == 0 {
			return nil
		}
	}
}

func (fw *frameWriter) json(kind byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return fw.frame(kind, b)
}

// frameReader reads frames from one stream.
type frameReader struct {
	r   *bufio.Reader
	buf []byte
}

func newFrameReader(r io.Reader) *frameReader {
	return &frameReader{r: bufio.NewReaderSize(r, 64<<10)}
}

// next reads a frame; its payload is valid until the next call.
func (fr *frameReader) next() (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(fr.r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > maxFrame {
		return 0, nil, fmt.Errorf("a frame of %d bytes: over %d", n, maxFrame)
	}
	if cap(fr.buf) < int(n) {
		fr.buf = make([]byte, n)
	}
	b := fr.buf[:n]
	if _, err := io.ReadFull(fr.r, b); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return hdr[0], b, nil
}
