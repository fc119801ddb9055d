package worker

import (
	"path/filepath"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/internal/auth"
)

// TestListenTCP: loopback takes plain TCP; anything else needs TLS, a
// certificate needs its key, a client CA needs TLS; a bad address is
// the caller's error.
func TestListenTCP(t *testing.T) {
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	withTLS := TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}
	for _, c := range []struct {
		addr string
		tls  TLS
		ok   bool
	}{
		{"tcp://127.0.0.1:0", TLS{}, true},
		{"tcp://[::1]:0", TLS{}, true},
		{"tcp://localhost:0", TLS{}, true},
		{"tcp://0.0.0.0:0", TLS{}, false},
		{"tcp://0.0.0.0:0", withTLS, true},
		{"tcp://127.0.0.1:0", TLS{Cert: withTLS.Cert}, false},
		{"tcp://127.0.0.1:0", TLS{ClientCA: filepath.Join(certs, auth.CAFile)}, false},
		{"tcp://127.0.0.1:0", TLS{Cert: withTLS.Cert, Key: withTLS.Key, ClientCA: filepath.Join(certs, auth.ServerKeyFile)}, false},
		{"127.0.0.1:0", TLS{}, false},
		{"tcp://nohost", TLS{}, false},
	} {
		l, err := listenTCP(c.addr, c.tls)
		if l != nil {
			l.Close()
		}
		if (err == nil) != c.ok || (err != nil && !errdefs.IsInvalidArgument(err)) {
			t.Errorf("%s %+v: %v", c.addr, c.tls, err)
		}
	}
}
