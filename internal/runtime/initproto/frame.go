package initproto

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"sync"
)

// Frames: what travels on each stream between a microVM's shim and its
// guest's agent (packages driver/microvms/vmm and agent). The two ends speak the
// init protocol of proto.go, but over a virtio-serial port, which passes
// bytes and no descriptors: one port carries a yamux session, and each
// request is a stream of its own, whose frames are a kind byte, a
// big-endian uint32 length and that many bytes.
//
//	shim                                       guest agent
//	  open a stream; FrameRequest{op, id, ...} ─▶
//	  (exec) FrameStdin ... FrameStdinEOF ─────▶ into the command's stdin
//	                 ◀─ FrameReply{id, pid}      started
//	                 ◀─ FrameStdout, FrameStderr its output, as it comes
//	                 ◀─ FrameReply{id, exit}     ended: after every byte it
//	                                             wrote before it ended
//	                 ◀─ FrameStdout ...          what its children write on
//	                                             until the pipes close; then
//	                                             the stream closes
//
// Other requests get their reply frames and the stream closes; the files
// request (opFiles) turns the rest of its stream into the file protocol
// (files_linux.go's remote half). Frames from the guest are untrusted:
// a length over maxFrame ends the stream.
const (
	FrameRequest  = 'q'
	FrameReply    = 'r'
	FrameStdin    = '0'
	FrameStdout   = '1'
	FrameStderr   = '2'
	FrameStdinEOF = 'e'
)

// MaxFrame bounds a frame's payload.
const MaxFrame = 1 << 20

// FrameWriter writes whole frames to one stream from any goroutine.
type FrameWriter struct {
	mu sync.Mutex
	w  io.Writer
}

// NewFrameWriter writes frames to w.
func NewFrameWriter(w io.Writer) *FrameWriter { return &FrameWriter{w: w} }

func (fw *FrameWriter) Frame(kind byte, p []byte) error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	for { // a long write as frames of maxFrame; an empty one as one frame
		n := min(len(p), MaxFrame)
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

func (fw *FrameWriter) JSON(kind byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return fw.Frame(kind, b)
}

// FrameReader reads frames from one stream.
type FrameReader struct {
	r   *bufio.Reader
	buf []byte
}

func NewFrameReader(r io.Reader) *FrameReader {
	return &FrameReader{r: bufio.NewReaderSize(r, 64<<10)}
}

// Next reads a frame; its payload is valid until the Next call.
func (fr *FrameReader) Next() (byte, []byte, error) {
	var hdr [5]byte
	if _, err := io.ReadFull(fr.r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > MaxFrame {
		return 0, nil, fmt.Errorf("a frame of %d bytes: over %d", n, MaxFrame)
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
