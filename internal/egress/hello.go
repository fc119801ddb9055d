package egress

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// MaxHello bounds the bytes a hello may take, its records' headers
// included: a ClientHello with post-quantum key shares is ~1.8 KiB, with
// padding up to a few; 64 KiB is what any client sends and more.
const MaxHello = 64 << 10

// ErrShort says the bytes end before the hello does: read more.
var ErrShort = errors.New("the hello continues past these bytes")

// Hello is what a ClientHello tells of where it goes.
type Hello struct {
	// ServerName is the server_name extension's host_name, as sent
	// (Normalize it before matching); "" when it has none.
	ServerName string
	// ECH: the hello carries encrypted_client_hello, and its real
	// server name is not ServerName.
	ECH bool
	// Len is how many bytes of the stream the hello took (its records
	// whole).
	Len int
}

// TLS wire constants.
const (
	recordHandshake   = 22
	typeClientHello   = 1
	extServerName     = 0
	extECH            = 0xfe0d
	extECHOuterExts   = 0xfd00
	nameTypeHost      = 0
	recordHeaderBytes = 5
	maxRecord         = 1<<14 + 2048 // a TLSCiphertext's bound; plaintext records are smaller
)

// ParseHello reads a TLS ClientHello from the first bytes a client
// sent: the handshake message may span records (each a handshake
// record), and the bytes may end early (ErrShort: read more and call it
// again with them all). Anything else that is not a hello is an error.
func ParseHello(b []byte) (Hello, error) {
	var r HelloReader
	return r.Parse(b)
}

// A HelloReader is ParseHello over bytes that grow: each Parse takes
// up the records where the last left off, so a hello that comes a few
// bytes at a time costs its length once, not its length squared.
type HelloReader struct {
	msg  []byte // the handshake message, its whole records' payloads joined
	off  int    // where the next record starts
	need int    // the message's length once its header is in (0: not yet)
}

// Parse is ParseHello of b, which starts with the bytes of every Parse
// before it.
func (r *HelloReader) Parse(b []byte) (Hello, error) {
	for r.need == 0 || len(r.msg) < r.need {
		if r.off+recordHeaderBytes > len(b) {
			return Hello{}, short(r.off)
		}
		h := b[r.off : r.off+recordHeaderBytes]
		if h[0] != recordHandshake {
			return Hello{}, fmt.Errorf("a TLS record of type %d where a handshake was due: not a TLS client", h[0])
		}
		if h[1] != 3 {
			return Hello{}, fmt.Errorf("TLS record version %d.%d: not a TLS client", h[1], h[2])
		}
		n := int(binary.BigEndian.Uint16(h[3:]))
		if n == 0 || n > maxRecord {
			return Hello{}, fmt.Errorf("a TLS record of %d bytes", n)
		}
		if r.off+recordHeaderBytes+n > len(b) {
			return Hello{}, short(r.off + recordHeaderBytes + n)
		}
		r.msg = append(r.msg, b[r.off+recordHeaderBytes:r.off+recordHeaderBytes+n]...)
		r.off += recordHeaderBytes + n
		if r.need == 0 && len(r.msg) >= 4 {
			if r.msg[0] != typeClientHello {
				return Hello{}, fmt.Errorf("handshake message type %d, not a ClientHello", r.msg[0])
			}
			r.need = 4 + (int(r.msg[1])<<16 | int(r.msg[2])<<8 | int(r.msg[3]))
			if r.need > MaxHello {
				return Hello{}, fmt.Errorf("a ClientHello of %d bytes, more than %d", r.need, MaxHello)
			}
		}
	}
	if len(r.msg) > r.need {
		return Hello{}, errors.New("the records after the ClientHello carry more handshake bytes")
	}
	h, err := parseClientHello(r.msg[4:])
	h.Len = r.off
	return h, err
}

func short(upto int) error {
	if upto > MaxHello {
		return fmt.Errorf("no ClientHello in the first %d bytes", MaxHello)
	}
	return ErrShort
}

// reader takes big-endian fields off a byte string; a field past the
// end sets bad.
type reader struct {
	b   []byte
	bad bool
}

func (r *reader) bytes(n int) []byte {
	if r.bad || n > len(r.b) {
		r.bad = true
		return nil
	}
	v := r.b[:n]
	r.b = r.b[n:]
	return v
}

func (r *reader) u8() int {
	v := r.bytes(1)
	if v == nil {
		return 0
	}
	return int(v[0])
}

func (r *reader) u16() int {
	v := r.bytes(2)
	if v == nil {
		return 0
	}
	return int(binary.BigEndian.Uint16(v))
}

// vec8 and vec16 take a vector with a 1- or 2-byte length.
func (r *reader) vec8() *reader  { return &reader{b: r.bytes(r.u8()), bad: r.bad} }
func (r *reader) vec16() *reader { return &reader{b: r.bytes(r.u16()), bad: r.bad} }

// parseClientHello reads the body of a ClientHello (RFC 8446 4.1.2).
func parseClientHello(body []byte) (Hello, error) {
	r := &reader{b: body}
	r.bytes(2)  // legacy_version
	r.bytes(32) // random
	r.vec8()    // legacy_session_id
	r.vec16()   // cipher_suites
	r.vec8()    // legacy_compression_methods
	if r.bad {
		return Hello{}, errors.New("a truncated ClientHello")
	}
	var h Hello
	if len(r.b) == 0 { // no extensions: no name
		return h, nil
	}
	exts := r.vec16()
	if r.bad || len(r.b) != 0 {
		return Hello{}, errors.New("a ClientHello's extensions do not fill it")
	}
	seen := map[int]bool{}
	for len(exts.b) > 0 {
		typ := exts.u16()
		data := exts.vec16()
		if exts.bad || data.bad {
			return Hello{}, errors.New("a truncated ClientHello extension")
		}
		if seen[typ] {
			return Hello{}, fmt.Errorf("a ClientHello with extension %d twice", typ)
		}
		seen[typ] = true
		switch typ {
		case extECH, extECHOuterExts:
			h.ECH = true
		case extServerName:
			name, err := serverName(data)
			if err != nil {
				return Hello{}, err
			}
			h.ServerName = name
		}
	}
	return h, nil
}

// serverName reads server_name's list (RFC 6066 3): one host_name.
func serverName(data *reader) (string, error) {
	list := data.vec16()
	if data.bad || list.bad || len(data.b) != 0 {
		return "", errors.New("a malformed server_name extension")
	}
	var name string
	for len(list.b) > 0 {
		typ := list.u8()
		v := list.vec16()
		if list.bad || v.bad {
			return "", errors.New("a malformed server_name extension")
		}
		if typ != nameTypeHost {
			continue
		}
		if name != "" {
			return "", errors.New("a server_name extension with two host names")
		}
		if len(v.b) == 0 {
			return "", errors.New("an empty server name")
		}
		name = string(v.b)
	}
	return name, nil
}
