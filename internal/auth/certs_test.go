package auth

import (
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/errdefs"
)

// TestMakeCerts: the worker's certificate verifies against the CA for
// each name and address given and no other; the client's verifies as a
// client; a TLS handshake with both succeeds, and one without the
// client's certificate is refused by a worker that asks for it; nothing
// is overwritten.
func TestMakeCerts(t *testing.T) {
	dir := t.TempDir()
	if err := MakeCerts(dir, []string{"worker.example", "127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	read := func(f string) []byte {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if fi, _ := os.Stat(filepath.Join(dir, ServerKeyFile)); fi.Mode().Perm() != 0o600 {
		t.Fatalf("key mode %v", fi.Mode())
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(read(CAFile))
	server, err := tls.X509KeyPair(read(ServerFile), read(ServerKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	client, err := tls.X509KeyPair(read(ClientFile), read(ClientKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(server.Certificate[0])
	for name, ok := range map[string]bool{"worker.example": true, "127.0.0.1": true, "other.example": false, "10.0.0.1": false} {
		_, err := leaf.Verify(x509.VerifyOptions{Roots: pool, DNSName: name})
		if (err == nil) != ok {
			t.Errorf("%s: %v", name, err)
		}
	}
	cleaf, _ := x509.ParseCertificate(client.Certificate[0])
	if _, err := cleaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Errorf("client: %v", err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{server}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			c.(*tls.Conn).Handshake()
			c.Write([]byte("x")) // read only by a client the worker took
			c.Close()
		}
	}()
	handshake := func(certs []tls.Certificate) error {
		c, err := tls.Dial("tcp", l.Addr().String(), &tls.Config{RootCAs: pool, ServerName: "worker.example", Certificates: certs})
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		_, err = c.Read(make([]byte, 1)) // TLS 1.3: a refused certificate shows at the first read
		return err
	}
	if err := handshake([]tls.Certificate{client}); err != nil {
		t.Fatalf("mTLS handshake: %v", err)
	}
	if err := handshake(nil); err == nil {
		t.Fatal("a client without a certificate got through")
	}
	// The CA signs for the worker's names alone: a certificate its key
	// signs for any other site does not verify (its key leaked, say).
	caBlock, _ := pem.Decode(read(CAFile))
	ca, _ := x509.ParseCertificate(caBlock.Bytes)
	if len(ca.PermittedDNSDomains) != 1 || len(ca.PermittedIPRanges) != 1 || !ca.PermittedDNSDomainsCritical {
		t.Fatalf("the CA's name constraints: %v %v", ca.PermittedDNSDomains, ca.PermittedIPRanges)
	}
	keyBlock, _ := pem.Decode(read(CAKeyFile))
	for name, ok := range map[string]bool{"bank.example": false, "10.0.0.1": false, "api.worker.example": true} {
		tmpl := &x509.Certificate{Subject: pkix.Name{CommonName: name}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
		if ip := net.ParseIP(name); ip != nil {
			tmpl.IPAddresses = []net.IP{ip}
		} else {
			tmpl.DNSNames = []string{name}
		}
		_, der, err := issue(tmpl, ca, keyBlock.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		forged, _ := x509.ParseCertificate(der)
		if _, err := forged.Verify(x509.VerifyOptions{Roots: pool, DNSName: name}); (err == nil) != ok {
			t.Errorf("a certificate for %s signed by the CA: %v", name, err)
		}
	}
	// A CA made for names of one kind signs for none of the other.
	for _, names := range [][]string{{"10.0.0.5"}, {"worker.example"}} {
		d := t.TempDir()
		if err := MakeCerts(d, names); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(filepath.Join(d, CAFile))
		block, _ := pem.Decode(b)
		ca, _ := x509.ParseCertificate(block.Bytes)
		kb, _ := os.ReadFile(filepath.Join(d, CAKeyFile))
		key, _ := pem.Decode(kb)
		roots := x509.NewCertPool()
		roots.AddCert(ca)
		for name, ok := range map[string]bool{names[0]: true, "bank.example": false, "10.9.9.9": false, "::1": false} {
			tmpl := &x509.Certificate{Subject: pkix.Name{CommonName: "x"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
				ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
			if ip := net.ParseIP(name); ip != nil {
				tmpl.IPAddresses = []net.IP{ip}
			} else {
				tmpl.DNSNames = []string{name}
			}
			_, der, err := issue(tmpl, ca, key.Bytes)
			if err != nil {
				t.Fatal(err)
			}
			c, _ := x509.ParseCertificate(der)
			if _, err := c.Verify(x509.VerifyOptions{Roots: roots, DNSName: name}); (err == nil) != ok {
				t.Errorf("a CA for %v, a certificate for %s: %v", names, name, err)
			}
		}
	}
	if err := MakeCerts(dir, []string{"x"}); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("over existing files: %v", err)
	}
	if err := MakeCerts(t.TempDir(), nil); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("no names: %v", err)
	}
}
